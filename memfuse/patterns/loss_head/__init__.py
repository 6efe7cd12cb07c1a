"""The loss head: linear + cross-entropy found in a model and computed in chunks.

    detect.py     finds it (one matcher; the fx rewrite of a Dynamo graph, a TorchFunctionMode in a trace)
    call.py       LossHeadCall: the op's arguments by name
    op.py         the custom ops and their autograd
    kernels.py    their Triton kernels
    plans.py      chunk rows and the vocabulary-major plan
    transform.py  LogitTransform: the model's transform of the logits
    rules.py      what the core must know of the ops (memfuse.ir.patterns)
"""
