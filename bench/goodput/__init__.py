"""Goodput: the highest rate at which a server meets its SLOs. `knee` finds the rate where
attainment falls below the target (pure), `stats` gives the intervals on its figures, `sweep`
runs the search against a server (`pdserve bench goodput`)."""
