"""``python -m pergrad.bench``: see ``pergrad.bench``."""

from pergrad.bench import main

main()
