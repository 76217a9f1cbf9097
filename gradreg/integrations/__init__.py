"""Penalties inside other libraries' training loops, each module imported by its path with the
extra it needs: :mod:`gradreg.integrations.hf_trainer` (transformers' ``Trainer`` and TRL's
trainers; the ``transformers`` extra) and :mod:`gradreg.integrations.engine_penalty` (loops over
DeepSpeed's engine; the ``deepspeed`` extra). Nothing here is imported by ``import gradreg``."""
