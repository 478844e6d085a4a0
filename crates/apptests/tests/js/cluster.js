// node's cluster module as PM2's cluster mode runs it: the primary listens
// and accepts every connection, then hands each accepted socket to one of
// its two workers (round-robin, over the IPC channel with SCM_RIGHTS);
// the workers answer HTTP. Prints "ready" once both workers listen.
//
// usage: node cluster.js PORT
const cluster = require('cluster');
const http = require('http');
const port = +process.argv[2];
if (cluster.isPrimary) {
  let listening = 0;
  cluster.schedulingPolicy = cluster.SCHED_RR;
  for (let i = 0; i < 2; i++) cluster.fork();
  cluster.on('exit', (w, code, signal) =>
    console.error('worker ' + w.process.pid + ' exited: ' + (signal || code)));
  cluster.on('listening', () => {
    if (++listening === 2) console.log('ready');
  });
} else {
  http
    .createServer((req, res) => res.end('worker ' + process.pid + '\n'))
    .listen(port, '127.0.0.1');
}
