"""The command line and the server: ``entry.py`` parses before the heavy imports, ``cli.py``
runs the sub-commands (over the library's jobs, ``landmark_memory/jobs``; ``cli_common.py`` what
they share, ``cli_measure.py`` the measuring ones), ``chat.py`` the
terminal chat, ``serve*.py`` the HTTP server and ``served.py`` a corpus served on Ray."""
