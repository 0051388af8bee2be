"""Engine adapters (HF learner, FSDP learner, vLLM sampler). Imported only when a command needs them."""
