"""What users run over a memory, as library functions (the command line in ``app/`` calls them;
so do the experiments): building memories from text files (``build.py``, on Ray in
``distributed.py``), evaluation (``evaluate.py``), the PNGs (``plots.py``) and the demo
(``demo.py``)."""
