"""Pure functions on tables: token metrics, framework conventions, token gaps, op errors, gate checks, NVFP4 reasons."""
