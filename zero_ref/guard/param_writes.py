"""Values written into the parameters from outside the engine: adopted when every rank wrote the
same, refused on every rank otherwise.

Users write parameters in place: `model.load_state_dict`, `nn.init`, `with torch.no_grad():
p.copy_(v)`, a weight clamped in its forward; and some modules write their own weight in their
forward: `nn.Embedding(max_norm=...)` renormalises the rows its batch looks up. Each rank writes
its own copy, and the engine does not see it happen, so at the next step (and before
`full_state_dict` or `save_checkpoint` read the masters):

1. Detect. torch counts in-place writes per tensor (`_version`). Stages 0-2 compare each
   parameter's count with the one noted when the engine last wrote it (`WriteRecord`); stage 3,
   whose parameters have values only while their unit is gathered, compares when the unit is
   freed with the count at its gather (stage3.py). A write into `param.data` is not counted.
2. Agree. The step's statistics all-reduce carries whether this rank found a write, so every rank
   learns on how many ranks one was made. Some ranks only: refused. Every rank: each sends a digest
   of its parameters (same_everywhere.value_digest, on the control channel, only then), and
   other values anywhere (a write that depends on each rank's batch, as max_norm's does) are
   refused too.
3. Adopt. In bf16/fp16 training reads the fp32 master and the parameters are its rounded copy, so
   the written elements become the master's (`WriteRecord.adopt`); in fp32 this rank's
   segments are the master already, and the regather rewrites the rest from equal values.
   Stage 3 cannot adopt: the freed buffer took the write with it while the gradients were computed
   from it, so it refuses any.

A refusal is a ValueError on every rank, before anything is updated.
"""

from __future__ import annotations

import torch

from .same_everywhere import ranks_with_other_values, value_digest


class WriteRecord:
    """What the engine last wrote into one engine's parameters, to tell a write from outside (step 1).

    Stages 0-2: each parameter's `_version` by identity (the first backward may lay the groups out
    anew). Stage 3: the stage itself names the first unit written while gathered
    (`Stage3.written_while_gathered`), since a unit's values exist only then."""

    def __init__(self, stage):
        self.stage = stage
        self.note()

    def _versions(self) -> dict[int, int]:
        return {id(param): param._version for group in self.stage.groups for param in group.params}

    def note(self) -> None:
        """The engine wrote the parameters (a step, a load): what they hold now is its own."""
        if self.stage.params_sharded:
            self.stage.written_while_gathered = None
        else:
            self.versions = self._versions()

    def written(self) -> bool:
        """Whether something outside the engine wrote into the parameters since it last did."""
        if self.stage.params_sharded:
            return self.stage.written_while_gathered is not None
        return self._versions() != self.versions

    def adopt(self) -> None:
        """Make the values written into this rank's pieces of the parameters its master's (only the
        elements that differ from the rounded master: the others keep the master's full precision;
        in fp32 the pieces are the master already)."""
        optimizer = self.stage.optimizer
        with torch.no_grad():
            for param, start, end, g, offset in self.stage.owned_pieces():
                if optimizer.low_precision[g] is None:
                    continue
                written = param.detach().reshape(-1)[start:end]
                master = optimizer.masters[g][offset:offset + end - start]
                master.copy_(torch.where(written != master.to(written.dtype), written.to(master.dtype), master))
        self.note()


def adopt_or_refuse(engine, record: WriteRecord, ranks_written: float | None = None) -> None:
    """Adopt the parameters' values written since the engine last wrote them, or refuse them on
    every rank (see the module). `ranks_written`: on how many ranks a write was found (step sums it
    with its statistics; None: count it here, one all-reduce of one element)."""
    stage = engine.stage
    if ranks_written is None:
        if stage.params_sharded:   # the step refuses what was lost; reading the masters is exact
            return
        flag = torch.tensor([float(record.written())], device=stage.device)
        if engine.comm.world_size > 1:
            engine.comm.all_reduce(flag, "sum", in_step=False)
        ranks_written = flag.item()
    if not ranks_written:
        return
    everyone = engine.ranks_summed
    on = f"on {int(ranks_written)} of {everyone} ranks"
    if stage.params_sharded:
        here = stage.written_while_gathered
        record.note()
        raise ValueError(
            f"stage 3: a parameter was written in place while its unit was gathered {on} (here: "
            f"{f'unit {here!r}' if here else 'none'}), inside a forward or backward: nn.Embedding(max_norm=...) "
            "renormalises the rows its batch looks up so. Stage 3 frees a unit's gathered parameters after "
            "use, so the write is lost, while this step's gradients were computed from the written values. "
            "Nothing was updated (engine.zero_grad() discards the gradients). Keep in-place writes out of "
            "the forward (renormalise without writing the weight), or write values with "
            "engine.load_state_dict")
    if ranks_written < everyone:
        raise ValueError(
            f"the parameters were written from outside the engine (in place: load_state_dict, nn.init, copy_) "
            f"{on}: the ranks would train different models. Nothing was changed; write the same values on "
            "every rank (engine.load_state_dict does it for you)")
    if everyone > 1:
        mine = value_digest([stage.param_buffer(g) for g in range(len(stage.groups))])
        differ = ranks_with_other_values(engine.comm.all_gather_object(mine), mine)
        if differ:
            raise ValueError(
                f"the parameters were written from outside the engine (in place) on every rank, but rank(s) "
                f"{', '.join(map(str, differ))} hold other values than rank {engine.comm.rank}: the ranks would "
                "train different models. A write that depends on each rank's batch does so: "
                "nn.Embedding(max_norm=...) renormalises, in its forward, the rows its batch looks up. Nothing "
                "was updated; keep such writes out of the forward (renormalise without writing the weight), "
                "and write the same values on every rank (engine.load_state_dict does it for you)")
    record.adopt()
