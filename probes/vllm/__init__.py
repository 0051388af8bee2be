"""The vLLM sampler: runner, op capture hooks, the plugin that installs recipes."""
