"""Print the command that joins another machine to the mesh this machine uses.

Run it where `gpumesh serve` runs (or anywhere the mesh's connection is saved or set):

    python examples/second_machine.py
"""

from pathlib import Path

from gpumesh import GPUMesh


def shown(path: Path) -> str:
    """``path`` as a user types it: under ~ where it is."""
    home = Path.home()
    return f"~/{path.relative_to(home)}" if path.is_relative_to(home) else str(path)


if __name__ == "__main__":
    with GPUMesh(quiet=True) as mesh:
        alive = [w for w in mesh.workers() if w["alive"]]
        print(f"This mesh ({mesh.url}) has {len(alive)} worker(s) now.")
        token_file = shown(mesh.settings.home / "token")  # where `gpumesh serve` saved it
        urls = mesh.lan_urls()
        if urls:
            print("On the other machine, with the same gpumesh version installed and the token")
            print(f"file copied there (scp {token_file} other:mesh.token, readable only by you):")
            print()
            print("    gpumesh join --token-file mesh.token")
            print()
            print("It finds this mesh on the LAN by itself. If the LAN hides it (another subnet, ")
            print("a VPN), name the coordinator:")
            print()
            print(f"    gpumesh join {urls[0]} --token-file mesh.token")
        else:
            port = mesh.url.rsplit(":", 1)[-1]
            print("Other machines cannot find this mesh: its coordinator is not advertised on")
            print("the LAN (it binds loopback only, the safe default, or discovery is off). On")
            print("the coordinator's machine, restart it with")
            print()
            print(f"    gpumesh serve --host 0.0.0.0 --port {port} --token-file {token_file}")
            print()
            print("read the warning it prints, and run this script again. With discovery off")
            print("(GPUMESH_DISCOVERY=0), join by the address serve prints:")
            print()
            print(f"    gpumesh join tcp://THAT_ADDRESS:{port} --token-file mesh.token")
