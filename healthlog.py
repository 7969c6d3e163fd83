"""healthlog (work in progress stub; the real module is being written)."""
__version__ = "0.1.0"


def main(argv=None):
    import sys
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:
        print("healthlog " + __version__)
        return 0
    return 2
