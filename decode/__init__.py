"""decode package of pdserve."""
