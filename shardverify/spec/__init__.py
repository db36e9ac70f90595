"""The spec model: YAML loading that keeps file and line (`loader`), field validation with
errors naming the field (`fields`), size limits (`limits`) and the op spec's frozen
dataclasses (`op`), and the catalogue every feature reads specs through: the kinds (`kinds`,
the op kind in `op_kind`), discovery, selection and loading (`catalogue`), the specs that may not
stand together (`conflicts`). Rendering specs into files is `shardverify.codegen`'s job; the
sharding rule notation is `shardverify.strategies.rules`.
"""
