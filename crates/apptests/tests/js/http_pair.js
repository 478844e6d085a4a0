// node's http module (libuv: epoll, non-blocking accept and connect) on both
// ends. `server PORT`: answers GET /N/SEED with N deterministic bytes.
// `client PORT SOCKETS REQUESTS`: keep-alive requests over SOCKETS
// connections, every body checked; prints `ok BYTES` where BYTES is what
// the client's sockets wrote and read, headers included.
"use strict";
const http = require("http");

function body(n, seed) {
  const b = Buffer.alloc(n);
  let x = (seed * 2654435761) >>> 0 || 1;
  for (let i = 0; i < n; i++) {
    x ^= x << 13; x >>>= 0; x ^= x >>> 17; x ^= x << 5; x >>>= 0;
    b[i] = x & 0xff;
  }
  return b;
}

const [mode, portArg, socketsArg, requestsArg] = process.argv.slice(2);
const port = Number(portArg);
if (mode === "server") {
  http.createServer((req, res) => {
    const [, n, seed] = req.url.split("/").map(Number);
    const b = body(n, seed);
    res.writeHead(200, { "content-length": b.length });
    res.end(b);
  }).listen(port, "127.0.0.1");
} else {
  const agent = new http.Agent({ keepAlive: true, maxSockets: Number(socketsArg) });
  const sockets = new Set();
  let left = Number(requestsArg);
  let running = 0;
  const sizes = [1, 612, 16384, 300000, 1 << 20];
  const fail = (m) => { console.error(m); process.exit(1); };
  const next = (i) => {
    if (i >= Number(requestsArg)) return;
    running++;
    const n = sizes[i % sizes.length];
    http.get({ host: "127.0.0.1", port, path: `/${n}/${i + 1}`, agent }, (res) => {
      sockets.add(res.socket);
      const parts = [];
      res.on("data", (c) => parts.push(c));
      res.on("end", () => {
        if (!Buffer.concat(parts).equals(body(n, i + 1))) fail(`body ${i} differs`);
        running--;
        left--;
        if (left === 0) {
          let bytes = 0;
          for (const s of sockets) bytes += s.bytesWritten + s.bytesRead;
          console.log(`ok ${bytes} ${sockets.size}`);
          agent.destroy();
        } else {
          next(i + Number(socketsArg));
        }
      });
    }).on("error", (e) => fail(e.stack));
  };
  for (let i = 0; i < Number(socketsArg); i++) next(i);
}
