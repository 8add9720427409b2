"""bench package of pdserve."""
