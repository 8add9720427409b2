"""`pdserve bench multiturn`: conversations whose turns resend their history, per config.

`main` deploys each config, `client` sends a conversation's turns (closed loop, think times
between them), `report` turns the turns into per-turn-index TTFT/TPOT, the share of prompt
tokens computed and transferred, the prefix hit rate and wrong answers, and plots TTFT by
turn. The conversations themselves come from `bench/serve/conversations.py`.
"""
