"""engine package of pdserve."""
