"""The verbs' operations, one room (subpackage) per verb family: probe, stitch (with graft), draft,
convert, inspect, diff, publish. A verb room imports only the shared rooms (shared, check, writing);
what one verb lends another is passed in by the caller (api/, cli/). tests/test_layers.py holds it.
"""
