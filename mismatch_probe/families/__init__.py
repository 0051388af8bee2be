"""Model families: one module per family defining ``SPEC`` (a :class:`~.base.FamilySpec`), found by
:mod:`.registry`; the canonical op vocabulary (:mod:`.opnames`).
Pure data and config reading: no engine import."""
