// Connects to 127.0.0.1:PORT, writes "hello", then destroys the socket:
// libuv closes the descriptor with syscall(SYS_close, fd).
//
// usage: node destroy.js PORT
const net = require('net');
const s = net.connect(+process.argv[2], '127.0.0.1', () => {
  s.write('hello', () => { s.destroy(); console.log('destroyed'); });
});
