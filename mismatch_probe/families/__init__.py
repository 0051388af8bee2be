"""Model families: one module per family defining ``SPEC`` (a :class:`~.base.FamilySpec`), found by
:mod:`.registry`; the canonical op vocabulary (:mod:`.opnames`); model resolution (:mod:`.models`).
Pure data and config reading: no engine import."""
