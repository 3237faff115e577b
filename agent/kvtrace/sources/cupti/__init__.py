"""`kvtrace run`'s CUPTI source: the tracer that runs inside the traced processes (tracer.py, started by
boot/sitecustomize.py), the protocol it speaks to the receiving side (protocol.py), and that side, which
decodes the records into the event model (decode.py, listener.py)."""
