"""ttt2la: turn test-time-training layers into chunk-parallel linear attention."""
__version__ = "0.1.0"
