"""A fake of the few parts of torch that kvtrace's CUPTI tracer touches, for tests that put
tests/fake_cupti/fake_torch on PYTHONPATH (never on the test process's own sys.path: other tests would
take it for torch). Like the real one, `import torch` imports torch.cuda."""
from torch import _C, autograd, cuda, version  # noqa: F401

__version__ = "2.9.0+fake"
