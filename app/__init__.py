"""app package of pdserve."""
