"""Declarative sharding rules: the notation (:mod:`.notation`), its binding to a call's shapes
(:mod:`.rule`), rules derived from the call (:mod:`.derive`), the spec options
(:mod:`.spec`) and the one generator family that serves them all (:mod:`.generator`)."""
