"""Print the command that joins another machine to the mesh this machine uses.

Run it where `gpumesh serve` runs (or anywhere the mesh's connection is saved or set):

    python examples/second_machine.py
"""

from gpumesh import GPUMesh

if __name__ == "__main__":
    with GPUMesh(quiet=True) as mesh:
        alive = [w for w in mesh.workers() if w["alive"]]
        print(f"This mesh ({mesh.url}) has {len(alive)} worker(s) now.")
        urls = mesh.lan_urls()
        if urls:
            print("On the other machine, with the same gpumesh version installed and the token")
            print("file copied there (scp ~/.gpumesh/token other:mesh.token, readable only by you):")
            print()
            print("    gpumesh join --token-file mesh.token")
            print()
            print("It finds this mesh on the LAN by itself. If the LAN hides it (another subnet, ")
            print("a VPN), name the coordinator:")
            print()
            print(f"    gpumesh join {urls[0]} --token-file mesh.token")
        else:
            print("Other machines cannot join yet: the coordinator is not advertised on the LAN")
            print("(it binds loopback only, which is the safe default). Restart it with")
            print()
            print("    gpumesh serve --host 0.0.0.0 --token-file ~/.gpumesh/token")
            print()
            print("read the warning it prints, and run this script again.")
