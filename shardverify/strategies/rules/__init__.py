"""Declarative sharding rules: the notation (:mod:`.notation`), its binding to a call's shapes
(:mod:`.rule`), rules derived from the call (:mod:`.derive`), the rule sources a spec's
options select and parse into (:mod:`.sources`) and the one generator family that serves them
all (:mod:`.generator`)."""
