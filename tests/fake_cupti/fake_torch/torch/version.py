"""torch.version: the CUDA torch was built for (FAKE_TORCH_CUDA overrides it, for subprocess tests)."""
import os

cuda = os.environ.get("FAKE_TORCH_CUDA", "13.0")
