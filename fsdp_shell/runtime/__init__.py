"""How plans run: the interpreter (one op in, one runtime call out), the device runtimes behind
the ``Runtime`` protocol (the host thread and a lane on the CPU, streams on an accelerator), the
flat-tensor collectives and their log, the process groups, and the reference interpreter that
runs a plan over every rank of a simulated world to check it."""
