"""kvtransfer package of pdserve."""
