"""``--sampler-arg`` / ``--learner-arg`` (issue #14): typed like vLLM's own engine arguments and HF's
from_pretrained kwargs; unknown keys, bad values, owned keys and conflicts are one-line errors.

The real-engine side (settings reach vLLM, the manifest and the report) is checked on the shared
tensor-parallel run in tests/test_tp.py.
"""

from __future__ import annotations

import pytest
from mp_testlib import cli

from mismatch_probe.errors import UsageError
from mismatch_probe.probes import engine_args as ea


def test_split_pairs() -> None:
    assert ea.split_pairs(["max-num-seqs=4", "a=b=c", "a=x"], "--sampler-arg") == {"max_num_seqs": "4", "a": "x"}
    with pytest.raises(UsageError, match="expected KEY=VALUE"):
        ea.split_pairs(["tensor_parallel_size"], "--sampler-arg")


def test_sampler_args_are_typed_by_vllms_parser() -> None:
    typed = ea.type_sampler_args(
        {"tensor_parallel_size": "2", "kv_cache_dtype": "fp8", "enforce_eager": "false", "block_size": "32",
         "enable_chunked_prefill": "true", "max_num_seqs": "4"}
    )
    assert typed == {"tensor_parallel_size": 2, "kv_cache_dtype": "fp8", "enforce_eager": False, "block_size": 32,
                     "enable_chunked_prefill": True, "max_num_seqs": 4}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"tensor_paralel_size": "2"}, "tensor_paralel_size: not a vLLM engine argument (did you mean tensor_parallel_size?)"),
        ({"kv_cache_dtype": "bogus"}, "invalid choice: 'bogus'"),
        ({"block_size": "abc"}, "invalid int value"),
        ({"enforce_eager": "maybe"}, "expected true or false"),
        ({"dtype": "float16"}, "set by --dtype"),
        ({"model": "/x"}, "set by --sampler-model"),
    ],
)
def test_bad_sampler_args_name_themselves(raw: dict, message: str) -> None:
    with pytest.raises(UsageError) as e:
        ea.type_sampler_args(raw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_settings_the_tool_needs() -> None:
    kw, auto = ea.sampler_kwargs({}, capture_on=True, recipe="engine")
    assert kw == {} and auto["enforce_eager"]["value"] is True and auto["enable_prefix_caching"]["value"] is False
    assert auto["enforce_eager"]["reason"] and auto["enable_prefix_caching"]["reason"]
    with pytest.raises(UsageError, match="enforce_eager=false conflicts with op capture"):
        ea.sampler_kwargs({"enforce_eager": "false"}, capture_on=True, recipe="engine")
    kw, _ = ea.sampler_kwargs({"enforce_eager": "0"}, capture_on=False, recipe="strict")  # decode graphs (CUDA)
    assert kw == {"enforce_eager": False}
    with pytest.raises(UsageError, match="compilation_config conflicts with the strict recipe"):
        ea.sampler_kwargs({"enforce_eager": "0", "compilation_config": '{"mode": 3}'}, capture_on=False, recipe="strict")
    with pytest.raises(UsageError, match="enable_prefix_caching=true conflicts with the prefill view"):
        ea.sampler_kwargs({"enable_prefix_caching": "true"}, capture_on=False, recipe="engine")
    kw, auto = ea.sampler_kwargs({"enforce_eager": "false"}, capture_on=False, recipe="engine")
    assert kw == {"enforce_eager": False} and "enforce_eager" not in auto  # allowed: nothing needs eager


def test_recipe_graphs() -> None:
    """A recipe in CUDA graphs: full decode graphs without torch.compile, or one line saying why not."""
    assert ea.recipe_graphs({"enforce_eager": True}, "strict", on_cpu=False, moe=False) is None
    assert ea.recipe_graphs({"enforce_eager": False}, "engine", on_cpu=False, moe=True) is None
    for recipe in ("strict", "nvfp4-per-token", "strict+nvfp4-per-token"):
        assert ea.recipe_graphs({"enforce_eager": False}, recipe, on_cpu=False, moe=False) == ea.RECIPE_COMPILATION
    for kw, recipe, message in ((dict(on_cpu=True, moe=False), "strict", "no CUDA graphs on the CPU"),
                                (dict(on_cpu=False, moe=True), "strict", "on a MoE model"),
                                (dict(on_cpu=False, moe=False), "nvfp4-static", "calibrates after"),
                                (dict(on_cpu=False, moe=False), "nvfp4-dynamic-tensor", "padding rows")):
        with pytest.raises(UsageError, match=message):
            ea.recipe_graphs({"enforce_eager": False}, recipe, **kw)
    assert ea.RECIPE_COMPILATION == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}


def test_learner_args(tmp_path) -> None:
    from mismatch_probe.probes.models import resolve_model

    model = resolve_model("tiny-qwen3").path
    assert ea.learner_kwargs({"attn_implementation": "eager", "rms_norm_eps": "1e-5"}, model) == {
        "attn_implementation": "eager", "rms_norm_eps": 1e-5}
    for raw, message in (
        ({"attn_implementation": "bogus"}, "attn_implementation=bogus: must be one of"),
        ({"rms_norm_epz": "1"}, "rms_norm_epz: not a from_pretrained argument or config attribute (did you mean rms_norm_eps?)"),
        ({"rms_norm_eps": "small"}, "expected a float"),
        ({"torch_dtype": "float16"}, "set by --dtype"),
    ):
        with pytest.raises(UsageError) as e:
            ea.learner_kwargs(raw, model)
        assert message in str(e.value), e.value


def test_learner_cuda_graphs_arg(tmp_path) -> None:
    from mismatch_probe.probes.models import resolve_model

    model = resolve_model("tiny-qwen3").path
    assert ea.learner_kwargs({"cuda_graphs": "true"}, model) == {"cuda_graphs": True}
    assert ea.learner_kwargs({"cuda_graphs": "false"}, model, capture_on=True, learner="fsdp") == {"cuda_graphs": False}
    for kw, message in (
        ({"capture_on": True}, "cuda_graphs=true conflicts with op capture (--capture)"),
        ({"learner": "fsdp"}, "cuda_graphs=true needs --learner hf"),
    ):
        with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
            ea.learner_kwargs({"cuda_graphs": "true"}, model, **kw)
    with pytest.raises(UsageError, match="expected true or false|cuda_graphs"):
        ea.learner_kwargs({"cuda_graphs": "maybe"}, model)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--learner-arg", "cuda_graphs=true"), "--learner-arg cuda_graphs=true conflicts with op capture"),
        (("--capture", "off", "--learner", "fsdp", "--learner-arg", "cuda_graphs=true"),
         "--learner-arg cuda_graphs=true needs --learner hf"),
        (("--capture", "off", "--learner-arg", "cuda_graphs=true"), "--learner-arg cuda_graphs=true needs a CUDA GPU"),
        (("--sampler-arg", "tensor_paralel_size=2"), "--sampler-arg tensor_paralel_size: not a vLLM engine argument"),
        (("--sampler-arg", "enforce_eager=false"), "--sampler-arg enforce_eager=false conflicts with op capture"),
        (("--align", "strict", "--capture", "off", "--sampler-arg", "enforce_eager=false"),
         "vLLM has no CUDA graphs on the CPU"),
    ],
)
def test_cli_one_line_error_exit_2(tmp_path, args: tuple[str, ...], message: str) -> None:
    out = tmp_path / "run"
    p = cli("compare", "--out", str(out), *args)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()  # (vLLM's import may log a line of its own first)
    assert "Traceback" not in p.stderr and lines[-1].startswith("error: ") and message in lines[-1]
    assert not out.exists()


def test_hf_learner_cuda_graphs_on_the_cpu_is_one_line_error() -> None:
    from mismatch_probe.probes.hf.runner import HfLearner
    from mismatch_probe.probes.models import resolve_model

    m = resolve_model("tiny-qwen3")
    with pytest.raises(UsageError, match="cuda_graphs=true needs a CUDA device, the learner runs on cpu"):
        with HfLearner(m.path, m.vocab_size, device="cpu", cuda_graphs=True):
            pass
