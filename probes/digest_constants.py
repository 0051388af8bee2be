"""The mixing constants of the ``mp64`` row digest (shared by every implementation of it)."""

GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
