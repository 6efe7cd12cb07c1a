"""CPU test setup: generated kernels run in Triton's interpreter; kernels go to a temp cache."""
import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MEMFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="memfuse-tests-"))
os.environ.setdefault("MEMFUSE_CHECK", "1")
