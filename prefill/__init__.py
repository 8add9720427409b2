"""prefill package of pdserve."""
