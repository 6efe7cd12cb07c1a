"""The patterns' table (memfuse.ir.patterns): the plug-ins register what the core needs to know of
their ops; capture, schedule, runtime and explain consult it and never import a pattern."""
import torch

import memfuse  # noqa: F401  (imports memfuse.patterns: the plug-ins register)
from memfuse.ir.patterns import DEFAULT, HOOKS, SECTIONS, Reads, called_op, rule
from memfuse.patterns.loss_head import op as loss_head
from memfuse.patterns.loss_head.call import OUTPUT, LossHeadCall, argument_index, trailing_nones
from memfuse.patterns.loss_head.transform import LogitTransform
from tests.test_imports import memfuse_graph

import networkx as nx

CORE = ("memfuse.capture", "memfuse.schedule", "memfuse.runtime", "memfuse.buffers", "memfuse.plan",
        "memfuse.codegen", "memfuse.ir", "memfuse.base")


def test_the_core_never_imports_a_pattern():
    graph = memfuse_graph()
    for module in graph.nodes:
        if module.startswith(CORE):
            reached = {m for m in nx.descendants(graph, module) if m.startswith("memfuse.patterns")}
            assert not reached, f"{module} imports {sorted(reached)}"
    # explain sits above the fronts (which call the patterns) but names none itself
    assert not [m for m in graph.successors("memfuse.reports.explain") if m.startswith("memfuse.patterns")]


def test_only_the_package_and_the_fronts_import_the_patterns():
    importers = set(memfuse_graph().predecessors("memfuse.patterns"))
    assert importers <= {"memfuse", "memfuse.fronts.backend", "memfuse.fronts.function", "memfuse.driver.compile"}


def test_a_rule_is_looked_up_with_a_default():
    assert rule(torch.ops.aten.mm.default) is DEFAULT
    head = rule(torch.ops.memfuse.linear_cross_entropy.default)
    assert head.reads is Reads.ANY_STRIDES and head.implementation is loss_head.linear_cross_entropy_impl
    assert rule(torch.ops.memfuse.linear_cross_entropy_backward.default).in_place is not None
    assert rule(torch.ops.memfuse.linear_cross_entropy_backward_all_.default).own_aliases == (0,)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert rule(flash).reads is Reads.LAST_DIM_IN_PLACE


def test_a_wrapper_target_keeps_the_rules_of_the_op_it_calls():
    class Wrapper:
        calls = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert called_op(Wrapper()) is Wrapper.calls and rule(Wrapper()).reads is Reads.LAST_DIM_IN_PLACE
    assert called_op(torch.ops.aten.mm.default) is torch.ops.aten.mm.default


def test_the_patterns_register_their_capture_hooks_and_report_sections():
    assert {"attention_masks", "attention_bias", "custom_backwards"} <= set(HOOKS)
    assert list(SECTIONS) == ["attention_masks", "attention_bias", "custom_backwards", "loss_heads"]
    assert {"loss_heads_chunked", "attention_masks_dropped", "attention_biases_fused"} <= set(memfuse.stats())


def test_a_loss_head_call_travels_by_name():
    args = ("h", "w", None, "t", -100, "mean", 0.0, torch.bfloat16, True, True, 1024, False, "rows", "div 30.0, tanh")
    call = LossHeadCall.of(args)
    assert (call.return_logits, call.differentiable_logits, call.plan) == (True, False, "rows")
    assert call.transform == LogitTransform((("div", 30.0), ("tanh", None)))
    assert call.args() == args
    short = LossHeadCall.of(args[:11])        # the schema's defaults fill the rest
    assert (short.differentiable_logits, short.plan, short.transform) == (True, "auto", LogitTransform())
    unwritten = call.without_logits().args()
    op = LossHeadCall.op()
    assert unwritten[argument_index(op, "return_logits")] is False
    assert unwritten[argument_index(op, "differentiable_logits")] is True
    assert OUTPUT["logits"] == 2 and len(trailing_nones(op, 3)) == 11
