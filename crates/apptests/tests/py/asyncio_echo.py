"""asyncio echo pair for the apptests: `server PORT` or `client PORT CONNS ROUNDS SEED`.

Frames are a 4-byte big-endian length and a payload; the server answers each
frame with the payload reversed. The client runs CONNS connections at once
(non-blocking connects and epoll, through asyncio's selector loop), checks
every answer and prints `ok SENT RECEIVED` (bytes on the wire, both ways).
"""
import asyncio
import random
import struct
import sys


async def serve(port):
    async def handle(reader, writer):
        try:
            while True:
                hdr = await reader.readexactly(4)
                (n,) = struct.unpack(">I", hdr)
                data = await reader.readexactly(n)
                writer.write(hdr + data[::-1])
                await writer.drain()
        except asyncio.IncompleteReadError as e:
            if e.partial:
                raise
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def one(port, rounds, rng, totals):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(rounds):
        n = rng.choice([1, 100, 1500, rng.randrange(1, 300_000)])
        data = rng.randbytes(n)
        writer.write(struct.pack(">I", n) + data)
        await writer.drain()
        hdr = await reader.readexactly(4)
        if struct.unpack(">I", hdr)[0] != n:
            raise SystemExit("length mismatch")
        back = await reader.readexactly(n)
        if back != data[::-1]:
            raise SystemExit("payload mismatch after %d bytes" % n)
        totals[0] += 4 + n
        totals[1] += 4 + n
    writer.close()
    await writer.wait_closed()


async def clients(port, conns, rounds, seed):
    totals = [0, 0]
    rngs = [random.Random(seed * 1000 + i) for i in range(conns)]
    await asyncio.gather(*(one(port, rounds, r, totals) for r in rngs))
    print("ok %d %d" % tuple(totals), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        asyncio.run(serve(int(sys.argv[2])))
    else:
        asyncio.run(clients(*map(int, sys.argv[2:6])))
