"""Python source that makes ``import torch`` fail as on a machine without it.

Prefix it to a ``python -c`` program. A finder that raises for torch is what a
missing package looks like: ``sys.modules['torch'] = None`` would leave a ``None``
under that name, which libraries probing ``sys.modules`` for torch (scipy's array
API layer does) mistake for an installed torch and fail on.
"""

BLOCK_TORCH = (
    "import sys, importlib.abc\n"
    "class _NoTorch(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'torch' or name.startswith('torch.'):\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "        return None\n"
    "sys.meta_path.insert(0, _NoTorch())\n"
)
