"""The spec model: YAML loading that keeps file and line (`loader`), field validation with
errors naming the field (`fields`), size limits (`limits`) and the op spec's frozen
dataclasses (`op`). Rendering specs into files is `shardverify.codegen`'s job; the sharding
rule notation is `shardverify.strategies.rules`.
"""
