"""ember command line; see `ember --help`."""


def main() -> None:
    print("ember: the command line arrives with the demo")
