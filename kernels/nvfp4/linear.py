"""The NVFP4 (W4A4) linear of the recipes: weights quantized once, activations on the fly.

:class:`NVFP4Linear` is the one object both engines build per linear layer, from the recipe's
scheme (as Transformer Engine pairs a recipe with its quantizer): the scheme decides the activation
quantizer and the weight quantization, :class:`tuning.GemmTuning` how the GEMM runs, and every call
goes through the one production GEMM, :mod:`tc_linear`. The three activation-scaling schemes of
docs/nvfp4.md "Scaling schemes":

* ``nvfp4-dynamic-tensor``: one amax over the whole current input (every row of the micro-batch,
  padding included: what TE does for activations), weights in 16x16 tiles (TE's default).
* ``nvfp4-static``: a calibrated input amax fixed after a calibration pass (vLLM serving
  checkpoints' ``input_global_scale``), weights in 1x16 blocks with one weight amax over the
  fused shards (vLLM takes the max over q/k/v and gate/up).
* ``nvfp4-per-token``: one amax per token row (batch-invariant by construction), 1x16 blocks,
  one weight amax per logical weight (q, k, v, gate, up, down each): the aligned scheme.

Backends (:func:`use_kernels`): on the CPU, and for non-bf16 activations, the pure-torch
reference (:func:`nvfp4_quantize_ref` + :func:`w4a4_gemm_ref`: exact block products, blocks
accumulated in K order in fp32, alpha in the epilogue); it is also the checker. On a CUDA GPU with
bf16 activations (sm_89+), the kernels: the quantizer (bitwise equal to the reference; CUDA C++ or Triton)
and the tensor-core GEMM of :mod:`tc_linear` (weights prepared once per weight version; decode path
for M <= 64, prefill path above, identical rows either way; within the GEMM tolerance of
docs/nvfp4.md of the per-block reference). Both GEMMs are batch invariant, so only the activation
scale decides whether a row's bits depend on its batch. :meth:`NVFP4Linear.kernel_summary` says what
ran.
"""

from __future__ import annotations

from typing import Any

import torch

from .ref import NVFP4Tensor, nvfp4_dequantize_ref, nvfp4_quantize_ref, w4a4_gemm_ref
from .schemes import SCHEMES, Scheme, quantize_weight_ref
from .tuning import DEFAULT, GemmTuning

CALIBRATION = {"on": False}  # process-global: static schemes record input amax instead of quantizing


def calibration_token_ids(vocab_size: int, n_seqs: int = 4, length: int = 48, seed: int = 1234) -> list[list[int]]:
    """The fixed calibration set both engines use for ``nvfp4-static`` (seeded random tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(8, vocab_size, (n_seqs, length), generator=g).tolist()


def qdq(x: torch.Tensor, mode: str, amax: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize ``x [rows, K]`` (pure torch): ``mode`` 'per-token' | 'per-tensor' |
    'static' (``amax`` given, fp32 [1]). For analysis and tests: what the GEMM sees, in x's dtype."""
    if mode not in ("per-token", "per-tensor", "static"):
        raise ValueError(f"mode must be per-token, per-tensor or static, got {mode!r}")
    if mode == "static" and amax is None:
        raise ValueError("static quantization needs the calibrated amax")
    q = nvfp4_quantize_ref(x, per_token=mode == "per-token", amax=amax if mode == "static" else None)
    return nvfp4_dequantize_ref(q, torch.float32).to(x.dtype)


SYNC_FAILED: list[str | None] = [None]  # the fused weight sync failed once in this process: the reference path after


def use_kernels(x: torch.Tensor) -> bool:
    """The kernels run for bf16 activations on a CUDA device of sm_89+ (``common.gpu_capable``); else
    the reference (the same function in both engines, slower)."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    from .common import gpu_capable

    return gpu_capable(x.device)


def _weight_key(w: torch.Tensor) -> tuple[Any, ...]:
    """The weight's address and version counter: an in-place update through autograd-visible ops bumps
    the counter; a write through ``.data``, or a new buffer at an old address (FSDP2's per-forward
    gather), does not change the key (the HF learner's patch keys by shape instead and calls
    :meth:`NVFP4Linear.invalidate` when the model's parameters change)."""
    return (w.data_ptr(), w._version, tuple(w.shape), w.device.type)


class SharedInput:
    """One activation quantization for the linears that read one tensor inside a scope: HF's q/k/v
    projections read the attention block's input, gate/up the MLP's (the HF learner's patch opens the
    scope around those modules' forwards). Within :meth:`open` of tensor ``x``, a linear whose input is
    ``x`` itself (the same object) reuses the quantized activation of the first one: for schemes whose
    activation quantization is a function of the input alone (per-token, dynamic per-tensor), the bits
    each linear would compute. Outside a scope, or for another input, nothing is shared or kept."""

    def __init__(self) -> None:
        self.src: torch.Tensor | None = None
        self.entry: tuple[Any, Any] | None = None  # (tag: which quantizer and layout, its result)
        self.hits = 0

    def open(self, x: Any) -> None:
        self.src = x if isinstance(x, torch.Tensor) else None
        self.entry = None

    def close(self) -> None:
        self.src = self.entry = None

    def get(self, x: torch.Tensor, tag: Any) -> Any:
        if self.src is None or x is not self.src or self.entry is None or self.entry[0] != tag:
            return None
        self.hits += 1
        return self.entry[1]

    def put(self, x: torch.Tensor, tag: Any, value: Any) -> Any:
        if self.src is not None and x is self.src:
            self.entry = (tag, value)
        return value


class NVFP4Linear:
    """One linear under an NVFP4 scheme: the scheme's quantizers, the quantized weight shards (cached),
    the static amax, and the GEMM (:mod:`tc_linear`) under ``tuning``.

    ``scheme``: a name of :data:`SCHEMES` (the recipe's ``linear``) or a :class:`Scheme`;
    ``partitions``: output sizes of the fused logical weights (vLLM ``qkv_proj`` / ``gate_up_proj``);
    per logical weight a weight amax, unless the scheme fuses them (static, vLLM style). ``tuning``:
    the GEMM's tuning (:data:`tuning.DEFAULT` for the recipes; its segment rule decides bits, so
    both engines must use the same).
    """

    def __init__(self, scheme: str | Scheme, partitions: list[int] | None = None, tuning: GemmTuning = DEFAULT) -> None:
        if isinstance(scheme, Scheme):
            scheme = scheme.name
        if scheme not in SCHEMES:
            raise ValueError(f"unknown NVFP4 scheme {scheme!r}; one of {', '.join(SCHEMES)}")
        self.scheme = SCHEMES[scheme]
        self.tuning = tuning
        self.partitions = list(partitions) if partitions else None
        self.static_amax: torch.Tensor | None = None
        self._wcache: dict[Any, tuple[tuple[Any, ...], list[NVFP4Tensor]]] = {}
        self._tcache: dict[Any, tuple[tuple[Any, ...], list[Any]]] = {}
        self.paths_used: dict[str, int] = {}  # "reference" | "cuda-native:decode" | "triton:decode" | "triton:prefill" -> calls
        self._last: tuple[int, Any] | None = None  # (M, TCWeight) of the last Triton call
        self.weight_prep = "not yet"  # how the GEMM's weight layouts were made: "fused sync" or the reference path
        # False: the quantized weights are cached per weight address and version counter. True (the HF
        # learner's patch, which calls invalidate() when the model's parameters change): per weight shape,
        # whatever buffer holds it (FSDP2 gathers a layer's weights into a new buffer at every forward)
        self.weights_by_shape = False
        self.shared: SharedInput | None = None  # set by the HF learner's patch: one quantization per input
        self.fused_inputs = 0  # calls whose activation quantization the producing op made (fused_input)

    def invalidate(self) -> None:
        """Drop the cached quantized weights (the weight's values changed)."""
        self._wcache.clear()
        self._tcache.clear()

    def _wkey(self, w: torch.Tensor) -> tuple[Any, ...]:
        return (tuple(w.shape), w.dtype, w.device.type) if self.weights_by_shape else _weight_key(w)

    def weight(self, w: torch.Tensor, key: Any = None) -> list[NVFP4Tensor]:
        """Quantized shards of ``w [N, K]`` (computed once per weight version)."""
        wk = self._wkey(w)
        hit = self._wcache.get(key)
        if hit is not None and hit[0] == wk:
            return hit[1]
        shards = quantize_weight_ref(w, self.scheme, self.partitions)
        self._wcache[key] = (wk, shards)
        return shards

    def prepared(self, w: torch.Tensor, key: Any = None) -> list[Any]:
        """The shards as :class:`tc_linear.TCWeight` (decode layout, fp16 operand), once per weight
        version and tuning (a new :attr:`tuning` prepares them again)."""
        from .tc_linear import prepare

        wk = self._wkey(w)
        hit = self._tcache.get(key)
        if hit is not None and hit[0] == wk and all(t.tuning is self.tuning for t in hit[1]):
            return hit[1]
        from . import sync

        tws = None
        if SYNC_FAILED[0] is None and w.is_cuda and sync.supported(w, self.scheme, self.partitions):
            try:  # 1x16 blocks: the fused weight sync (bitwise the reference path)
                tws = sync.sync_weight(w, self.scheme, self.partitions, self.tuning)
                self.weight_prep = "fused sync"
            except Exception as e:  # noqa: BLE001 - a kernel that fails to build here: the reference path, recorded
                SYNC_FAILED[0] = f"{type(e).__name__}: {str(e)[:200]}"
        if tws is None:
            tws = [prepare(q, self.tuning) for q in self.weight(w, key)]
            self.weight_prep = "reference" + (f" (fused sync failed: {SYNC_FAILED[0]})" if SYNC_FAILED[0] else "")
        self._tcache[key] = (wk, tws)
        return tws

    def quantize_input(self, x2: torch.Tensor, amax: torch.Tensor | None, tw: Any) -> tuple[NVFP4Tensor, torch.Tensor | None]:
        """The scheme's activation quantizer on the kernel path: (codes/scales/amax, the GEMM's fp16
        operand when the one-pass per-token quantizer made it, in the layout the GEMM of ``tw`` takes)."""
        from .quant_fast import MAX_K, quantize_rows
        from .tc_linear import OP_DTYPE, operand_layout
        from .triton_quant import nvfp4_quantize

        if self.scheme.per_token and x2.shape[1] <= MAX_K:  # one pass: codes, scales, amax and the fp16 operand
            layout = operand_layout(x2.shape[0], tw, "auto")  # the one the native decode GEMM takes, where it runs
            codes, scales, amax_t, op = quantize_rows(x2, None, True, emit_op=OP_DTYPE, op_layout=layout)
            return NVFP4Tensor(codes, scales, amax_t, True), op
        return nvfp4_quantize(x2, per_token=self.scheme.per_token, amax=amax), None

    def _quantized_input(self, src: torch.Tensor, x2: torch.Tensor, amax: torch.Tensor | None, tw: Any) -> Any:
        """:meth:`quantize_input`, or (per-token) the quantization the op that made ``src`` (a norm, an
        act-and-mul) wrote with it (:func:`fused_input.take`), or (inside a :class:`SharedInput` scope,
        input-only schemes) the quantization an earlier linear made of the same input tensor ``src``."""
        from . import fused_input
        from .tc_linear import operand_layout

        tag = fused_input.tag(operand_layout(x2.shape[0], tw, "auto"), self.scheme.per_token)
        if amax is None and self.scheme.per_token:  # made by the op that produced it, if it could
            got = fused_input.take(src, tw, tag)
            if got is not None:
                self.fused_inputs += 1
                return got
        sh = self.shared if amax is None else None
        if sh is None:
            return self.quantize_input(x2, amax, tw)
        hit = sh.get(src, tag)
        return hit if hit is not None else sh.put(src, tag, self.quantize_input(x2, amax, tw))

    def _kernel_matmul(self, x2: torch.Tensor, w: torch.Tensor, amax: torch.Tensor | None, key: Any,
                       src: torch.Tensor | None = None) -> torch.Tensor:
        from .tc_linear import OP_DTYPE, choose, tc_matmul_shards, use_native

        before = self._tcache.get(key)
        tws = self.prepared(w, key)
        # the weights were made by the sync kernels just now, unless they came from the cache
        synced = before is None or before[1] is not tws
        x2 = x2.detach().contiguous()
        sh = self.shared
        hits = sh.hits if sh is not None else 0
        qa, op = self._quantized_input(x2 if src is None else src, x2, amax, tws[0])
        quantized = sh is None or sh.hits == hits  # the quantizer ran now: it is the last kernel launched
        # the activation is quantized once for all shards; each GEMM follows the quantizer or the shard before
        # it (kernels that write no weight: the GEMM may start streaming its weights before they end); on the
        # wgmma decode path the shards are one launch writing one output (tc_matmul_shards)
        y = tc_matmul_shards(qa, tws, a_op=op, after_own_kernel=quantized or not synced)
        path = choose(x2.shape[0], tws[0])
        native = path == "decode" and use_native(tws[0], op if op is not None else x2.new_empty(0, dtype=OP_DTYPE), tws[0].nseg)
        tag = f"{'cuda-native' if native else 'triton'}:{path}"
        self.paths_used[tag] = self.paths_used.get(tag, 0) + 1
        self._last = (x2.shape[0], tws[0])
        return y

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, key: Any = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        s = self.scheme
        if s.static and (CALIBRATION["on"] or (self.static_amax is None and CALIBRATION.get("warmup"))):
            # calibrating, or an engine's own warm-up forward before the calibration pass (vLLM's
            # profile and dummy runs on CUDA): unquantized, recording the amax only when calibrating
            if CALIBRATION["on"]:
                a = x2.detach().float().abs().amax().reshape(1)
                self.static_amax = a if self.static_amax is None else torch.maximum(self.static_amax, a)
            y = torch.nn.functional.linear(x2, w.to(x2.dtype))
        else:
            if s.static and self.static_amax is None:
                raise RuntimeError("nvfp4-static: no calibrated input scale (run the calibration pass first)")
            amax = self.static_amax.to(x2.device) if s.static else None
            sh = self.shared if amax is None else None
            if use_kernels(x2) and x2.shape[0] > 0:
                y = self._kernel_matmul(x2, w, amax, key, x)
            else:
                tag = ("reference", s.per_token)
                qa = sh.get(x, tag) if sh is not None else None
                if qa is None:
                    qa = nvfp4_quantize_ref(x2.detach(), per_token=s.per_token, amax=amax)
                    if sh is not None:
                        sh.put(x, tag, qa)
                y = torch.cat([w4a4_gemm_ref(qa, qw, out_dtype=torch.float32) for qw in self.weight(w, key)], dim=-1)
                self.paths_used["reference"] = self.paths_used.get("reference", 0) + 1
            y = y.to(x.dtype)
        if bias is not None:
            y = (y.float() + bias.float()).to(x.dtype)
        return y.reshape(*shape[:-1], w.shape[0])

    def kernel_summary(self) -> dict[str, Any]:
        """What computed this linear so far: backend per path with call counts, the last Triton
        kernel's config, Triton / torch / CUDA versions (for the run manifest)."""
        kernel = None
        if self._last is not None:
            from .tc_linear import kernel_record

            kernel = kernel_record(*self._last)
        return {"paths_used": dict(sorted(self.paths_used.items())), "kernel": kernel, "weight_prep": self.weight_prep,
                "input_quantized_upstream": self.fused_inputs}

    def describe(self) -> dict[str, Any]:
        s = self.scheme
        return {
            "kernels": self.kernel_summary(),
            "scheme": s.name,
            "activation_amax": "per-token" if s.per_token else ("static" if s.static else "dynamic per-tensor"),
            "weight_blocks": "16x16" if s.weight_tile16 else "1x16",
            "weight_amax": "fused shards" if s.fused_weight_amax else "per logical weight",
            "static_amax": None if self.static_amax is None else float(self.static_amax),
        }


def explain_pair(x: torch.Tensor, w: torch.Tensor, a: NVFP4Linear, b: NVFP4Linear) -> dict[str, Any]:
    """Why two NVFP4 linears (e.g. the learner's and the sampler's state of one layer) disagree on
    the same input ``x [rows, K]`` and weight: activation scaling, weight quantization, or neither.
    For ``bisect``: a first divergent quantized linear gets its reason from here."""
    x2 = x.reshape(-1, x.shape[-1]).detach()

    def act(s: NVFP4Linear) -> NVFP4Tensor:
        amax = s.static_amax.to(x2.device) if s.scheme.static and s.static_amax is not None else None
        return nvfp4_quantize_ref(x2, per_token=s.scheme.per_token, amax=amax)

    qa, qb = act(a), act(b)
    wa, wb = a.weight(w, key="explain"), b.weight(w, key="explain")
    act_codes = float((qa.codes != qb.codes).float().mean())
    act_scales = float((qa.scales != qb.scales).float().mean())
    w_codes = float(torch.cat([(p.codes != q.codes).float().reshape(-1) for p, q in zip(wa, wb, strict=True)]).mean())
    pairs = list(zip(wa, wb, strict=True))
    w_amax_differ = any(not torch.equal(p.amax, q.amax) or not torch.equal(p.scales, q.scales) for p, q in pairs)
    ya, yb = a(x2, w, key="explain"), b(x2, w, key="explain")
    reasons = []
    if act_codes or act_scales or not torch.equal(qa.row_amax(), qb.row_amax()):
        reasons.append("activation scaling")
    if w_codes or w_amax_differ:
        reasons.append("weight quantization")
    return {
        "schemes": [a.scheme.name, b.scheme.name],
        "activation_amax": [a.describe()["activation_amax"], b.describe()["activation_amax"]],
        "activation_codes_differ_frac": act_codes,
        "activation_scales_differ_frac": act_scales,
        "weight_codes_differ_frac": w_codes,
        "output_max_abs_diff": float((ya.float() - yb.float()).abs().max()),
        "reason": " and ".join(reasons) if reasons else "none (same quantization)",
    }
