"""Reductions in a row kernel: over D in registers; over M into per-program partials that the last
program to finish combines into the totals (`finish_column_sums`), so the kernel is the whole column sum."""
from __future__ import annotations

import torch

from memfuse.base.source import Lines
from memfuse.codegen.emit import dtype_name
from memfuse.ir.graph import Kind, Node, Op
from memfuse.ir.ops import ARG_REDUCE, REDUCE, TRITON_DTYPES


class ColumnSums:
    """RowKernelWriter's reductions and the finish of its column sums."""

    def reduce_types(self, node: Node) -> tuple:
        """(accumulator dtype, neutral literal) of a reduction: floats accumulate in fp32
        (fp64 stays fp64), integer sums in the result's int dtype."""
        src = self.graph[node.inputs[0]].value.dtype
        if node.value.is_floating or node.op in ARG_REDUCE:
            acc = torch.float64 if torch.float64 in (src, node.value.dtype) else torch.float32
        else:
            acc = node.value.dtype
        if node.op in ARG_REDUCE:
            return acc, "float('-inf')"
        return acc, REDUCE[node.op].neutral if acc.is_floating_point else "0"

    def reduce_source(self, node: Node) -> tuple:
        """(masked source expression, accumulator dtype, neutral literal) of a reduction."""
        acc, neutral = self.reduce_types(node)
        source = self.operand(node.inputs[0], Kind.FULL, acc, node.value.dtype)
        if node.op is Op.ARGMIN:
            source = f"-{source}"
        return f"tl.where(mask, {source}, {neutral})", acc, neutral

    def reduce(self, out: Lines, node: Node) -> None:
        masked, _, _ = self.reduce_source(node)
        target = self.reg(node.name)
        if node.op in ARG_REDUCE:   # the first extreme of the row (NaN first): an int64 index
            self.use("mf_arg_best")
            out(f"{target}_best, {target} = mf_arg_best({masked}, cols)")
            out(f"{target} = {target}.to(tl.int64)")
            return
        info = REDUCE[node.op]
        self.use(info.helper)
        if node.attr.axis is Kind.ROW:
            out(f"{target} = {info.triton.format(masked, 1)}")
            return
        acc = f"{target}_acc"
        out(f"{acc} = {info.combine.format(acc, info.triton.format(masked, 0))}")

    def finish_column_sums(self, out: Lines) -> None:
        """The programs combine their partials into the totals themselves: the kernel is the
        whole column sum, one launch and no finishing call on the host. In two levels, so no
        single program reads every partial (one SM's share of L2 bandwidth would make that the
        kernel's tail): the programs form groups of about sqrt(programs); the last program of a
        group to write its partials combines the group's rows into the group's first row, and
        the last group to finish combines those rows into the totals.

        Memory model (PTX): a program's threads store their partials, meet at a barrier, and one
        thread takes a ticket with an acq_rel atomic at GPU scope: the barrier orders the other
        threads' stores before the atomic, whose release publishes them. The program that draws
        a group's last ticket has acquired every earlier release of the group; a second barrier
        orders all of its threads' loads after that acquire, and the loads read at L2 (`.cg`, the
        GPU's point of coherence), never a line this SM's L1 kept from earlier. The group's row
        is published to the last group the same way. Both levels combine rows in program order
        (deterministic, whichever program finished last) and set their counters back to 0 for
        the next launch or CUDA-graph replay."""
        out("# finish: the last program of each group combines the group's partials into its first row,")
        out("# then the last group to finish combines the groups' rows into the totals")
        out("group_size = tl.ceil(tl.sqrt(num_programs.to(tl.float32))).to(tl.int32)")
        out("groups = tl.cdiv(num_programs, group_size)")
        out("group = pid // group_size")
        out("group_first = group * group_size")
        out("group_end = tl.minimum(num_programs, group_first + group_size)")
        out("tl.debug_barrier()  # all threads' partial stores come before the ticket (its release)")
        out('ticket = tl.atomic_add(done_ptr + 1 + group, 1, sem="acq_rel", scope="gpu")')
        out("if ticket == group_end - group_first - 1:")
        out.indent()
        out("tl.debug_barrier()  # the ticket (its acquire) comes before any thread reads the group's partials")
        self.combine_level(out, "group_first", "group_end", "1", totals=False)
        out("tl.store(done_ptr + 1 + group, 0)  # the next launch (or graph replay) counts from zero")
        out("tl.debug_barrier()  # the group's row comes before its ticket for the last group")
        out('group_ticket = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")')
        out("if group_ticket == groups - 1:")
        out.indent()
        out("tl.debug_barrier()  # the ticket (its acquire) comes before any thread reads the groups' rows")
        self.combine_level(out, "0", "num_programs", "group_size", totals=True)
        out("tl.store(done_ptr, 0)")
        out.dedent()
        out.dedent()

    def combine_level(self, out: Lines, first: str, end: str, step: str, totals: bool) -> None:
        """One level of the finish over the whole row (in chunks of columns where it has them)."""
        chunked = self.open_finish_columns(out)
        self.combine_partials(out, first, end, step, totals)
        if chunked:
            out.dedent()

    def combine_partials(self, out: Lines, first: str, end: str, step: str, totals: bool) -> None:
        """Combine the partials rows first, first + step, ... (below `end`) of the columns `cols`
        covers, BLOCK_M rows at a time in order, in the partials' dtype; then store the result
        into row `first` (a group's row) or, rounded to each value's dtype, into the totals."""
        for op, names in self.sums.items():
            for name in names:
                acc = TRITON_DTYPES[self.partials_dtypes[op]]
                out(f"{self.reg(name)}_total = tl.full([BLOCK_D], {REDUCE[op].neutral}, {acc})")
        out(f"for block in range({first}, {end}, BLOCK_M * {step}):" if step != "1"
            else f"for block in range({first}, {end}, BLOCK_M):")
        out.indent()
        spacing = "" if step == "1" else f" * {step}"
        out(f"programs = (block + tl.arange(0, BLOCK_M){spacing}).to(tl.int64)")
        out(f"partials_mask = (programs < {end})[:, None] & col_mask[None, :]")
        for op, names in self.sums.items():
            info = REDUCE[op]
            for j, name in enumerate(names):
                self.use(info.helper)
                value = self.reg(name)
                out(f"{value}_partials = tl.load(partials_{op.value}_ptr + (programs[:, None] * {len(names)} + {j}) * D "
                    f"+ cols[None, :], mask=partials_mask, other={info.neutral}, cache_modifier=\".cg\")")
                out(f"{value}_total = {info.combine.format(f'{value}_total', info.triton.format(f'{value}_partials', 0))}")
        out.dedent()
        if not totals:
            for op, names in self.sums.items():
                for j, name in enumerate(names):
                    out(f"tl.store(partials_{op.value}_ptr + ({first} * {len(names)} + {j}) * D + cols, "
                        f"{self.reg(name)}_total, mask=col_mask)")
            return
        for dtype, names in self.totals.items():
            for j, name in enumerate(names):
                out(f"tl.store(totals_{dtype_name(dtype)}_ptr + {j} * D + cols, {self.finished(name)}, mask=col_mask)")

    def finished(self, name: str) -> str:
        """A totals row's value: its sum's total rounded to the sum's dtype (bf16 / fp16 values
        round once), then through each cast the kernel applies to it (KernelGroup.column_casts)."""
        total = self.summed.get(name, name)
        current = self.partials_dtypes[self.graph[total].op]
        text = f"{self.reg(total)}_total"
        for value in (total, *self.group.column_casts.get(total, ())):
            dtype = self.graph[value].value.dtype
            if dtype in (torch.bfloat16, torch.float16) and dtype != current:
                text = self.narrow(text if current == torch.float32 else f"{text}.to(tl.float32)", dtype)
            elif dtype != current:
                text = f"{text}.to({TRITON_DTYPES[dtype]})"
            current = dtype
        return text

    def open_finish_columns(self, out: Lines) -> bool:
        """Open the finish's walk over columns; True when it opened a loop to close. A row is
        whole in registers here: `cols` already covers it."""
        return False
