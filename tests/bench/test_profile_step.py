"""benchmarks.profile_step's launch census (--origins): what each launch is filed under, and which
rows come first. The profiling itself needs CUDA; these are its pure parts."""
from collections import Counter

from benchmarks.profile_step import ORIGIN_DEPTH, launch_origin, origin_rows


def test_a_launch_is_filed_under_its_op_and_parents_an_aten_kernel_by_its_stem():
    stack = ["aten::copy_", "aten::_to_copy", "aten::to", "CompiledFunctionBackward"]
    origin, kernel = launch_origin(stack, "void at::native::vectorized_elementwise_kernel<4, at::native::Copy>(int)")
    assert origin == " < ".join(stack[:ORIGIN_DEPTH])
    assert kernel == "void at::native::vectorized_elementwise_kernel"


def test_triton_kernels_are_one_label_whoever_generated_them():
    assert launch_origin(["CompiledFunction"], "memfuse_forward_3")[1] == "triton"
    assert launch_origin(["triton_poi_fused_add_0"], "triton_poi_fused_add_0")[1] == "triton"
    assert launch_origin(["aten::mm"], "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT")[1] != "triton"


def test_rows_whose_counts_differ_most_come_first():
    counts = {"torch_compile": Counter({("aten::mm", "gemm"): 50, ("triton_fused", "triton"): 5}),
              "memfuse_backend": Counter({("aten::mm", "gemm"): 50, ("aten::embedding_dense_backward", "sort"): 20,
                                          ("aten::to", "copy"): 8})}
    rows = origin_rows(counts, top=3)
    assert rows[0] == ([0, 20], "aten::embedding_dense_backward", "sort")
    assert rows[1] == ([0, 8], "aten::to", "copy")
    assert rows[2] == ([5, 0], "triton_fused", "triton")
    assert len(origin_rows(counts, top=10)) == 4
