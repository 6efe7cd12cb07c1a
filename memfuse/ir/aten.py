"""aten targets by how an EXTERN call of them reads memory (capture keeps views for them, and
memfuse.schedule.padding pads the operands they read)."""
import torch

from memfuse.ir.patterns import Reads, rule

aten = torch.ops.aten

# aten calls that read a tensor of any strides where it lies (aten.view does not: it may need a copy);
# ops a pattern registered so read as well (memfuse.ir.patterns: reads_any_strides).
ANY_STRIDES_ATEN = {aten.mm.default, aten.mm.dtype, aten.bmm.default, aten.addmm.default, aten.permute.default,
                    aten.slice.Tensor, aten.narrow.default, aten.select.int, aten.expand.default,
                    aten.unsqueeze.default, aten.squeeze.dims, aten.alias.default}


def reads_any_strides(target) -> bool:
    """Whether an extern call reads its tensor operands in any strides, where they lie."""
    return target in ANY_STRIDES_ATEN or rule(target).reads is Reads.ANY_STRIDES


# Matmuls: extern (cuBLAS) calls whose operands memfuse.schedule.padding may align (ir.Matmul).
MATMUL_ATEN = {aten.mm.default, aten.bmm.default, aten.addmm.default}
