"""Generated from proto/ by proto/generate.py; never edit by hand."""
