"""`pdserve bench autoscale`: a ramp that stresses each pool's own signal in turn (`main`): the
ramp and its requests (`load`), its rates from measured capacity (`plan`, pure; `probe`
measures), and the verdict (`report`)."""
