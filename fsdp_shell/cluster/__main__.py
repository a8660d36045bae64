"""``python -m fsdp_shell.cluster``: the emulated cluster's self-check (``check``)."""

from fsdp_shell.cluster.check import main

if __name__ == "__main__":
    main()
