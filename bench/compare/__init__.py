"""`pdserve bench compare`: goodput of several configs on this machine, with intervals
(`main`), one config's run (`run`), what the runs conclude (`report`), the results and their
checkpoints (`store`), quieter measurements (`quiet`); `pdserve bench summary` (`summary`)
tables several comparisons."""
