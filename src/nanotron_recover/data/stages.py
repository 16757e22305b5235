"""Which data stage feeds a step, and the micro-batch source it reads from.

Nanotron's ``data_stages`` switch datasets at a step: the stage of step ``s`` is the last one whose
``start_training_step <= s``. Here each stage's source is opened (and so checked) once, and a stage
starting at step ``S`` reads its data from its own beginning: its first micro-batch id,
``(S - 1) * B``, is slot 0 of its Nanoset. So the tokens of micro-batch ``m`` stay a function of
the config and ``m`` alone, across stage switches, resumes and faults alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanotron_recover.data.microbatches import MicroBatchSource, build_microbatch_source

if TYPE_CHECKING:
    from nanotron_recover.config import Config


class DataStages:
    """The config's data stages, each opened on first use (or all at once by :meth:`open_all`)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._sources: dict[int, MicroBatchSource] = {}

    def first_id(self, start_training_step: int) -> int:
        """The first micro-batch id of a stage starting at ``start_training_step``."""
        return (max(start_training_step, 1) - 1) * self.cfg.microbatches_per_step

    def for_step(self, step: int) -> MicroBatchSource:
        """The source of (1-based) ``step``'s micro-batches."""
        from nanotron_recover.config import NanosetDatasetsArgs

        stage = self.cfg.stage_for_step(step)
        key = stage.start_training_step
        if key not in self._sources:
            ds = stage.data.dataset
            nanoset = ds if isinstance(ds, NanosetDatasetsArgs) else None
            check_tokenizer = nanoset is not None and nanoset.validate_tokenizer
            t = self.cfg.tokens
            self._sources[key] = build_microbatch_source(
                nanoset,
                vocab_size=self.cfg.model.model_config.vocab_size,
                micro_batch_size=t.micro_batch_size,
                sequence_length=t.sequence_length,
                seed=stage.data.seed if stage.data.seed is not None else self.cfg.general.seed,
                first_id=self.first_id(stage.start_training_step),
                # The folders must come from the config's tokenizer (their .ds.metadata names it).
                tokenizer_name_or_path=self.cfg.tokenizer.tokenizer_name_or_path if check_tokenizer else None,
            )
        return self._sources[key]

    def open_all(self) -> None:
        """Open (and so check) every stage now, not when its first step comes."""
        for stage in self.cfg.data_stages:
            self.for_step(max(stage.start_training_step, 1))
