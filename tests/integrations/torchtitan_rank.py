"""One torchtitan rank on CPU: the shim (``torchtitan_cpu``), then ``torchtitan.train``.

Run under ``torchrun`` with torchtitan's own arguments (``--module ... --config ...``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from torchtitan_cpu import install  # noqa: E402

install()

from torchtitan.train import main  # noqa: E402

if __name__ == "__main__":
    main()
