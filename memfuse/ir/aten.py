"""aten targets by how an EXTERN call of them reads memory (capture keeps views for them, and
memfuse.schedule.padding pads the operands they read)."""
import torch

aten = torch.ops.aten

# aten calls that read a tensor of any strides where it lies (aten.view does not: it may need a copy).
# memfuse.capture.tables adds the chunked loss head's ops where it registers them.
ANY_STRIDES_ATEN = {aten.mm.default, aten.mm.dtype, aten.bmm.default, aten.addmm.default, aten.permute.default,
                    aten.slice.Tensor, aten.narrow.default, aten.select.int, aten.expand.default,
                    aten.unsqueeze.default, aten.squeeze.dims, aten.alias.default}
# Matmuls: extern (cuBLAS) calls whose operands memfuse.schedule.padding may align (ir.Matmul).
MATMUL_ATEN = {aten.mm.default, aten.bmm.default, aten.addmm.default}
