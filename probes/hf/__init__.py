"""The HF transformers learner: runner, op capture hooks, the recipe patch."""
