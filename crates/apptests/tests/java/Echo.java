// Java servers and clients for crates/apptests/tests/java.rs, each run under
// `smclo run`:
//   server PORT          thread-per-connection echo server (ServerSocket)
//   nioserver PORT       one-thread Selector echo server (non-blocking NIO)
//   client PORT CONNS    CONNS connections from a pool of 8 threads, each
//                        writing a pseudo-random message (one thread) while
//                        reading the echo (another), then shutdownOutput;
//                        prints "ok CONNS BYTES" if every echo is exact
//   load PORT THREADS SECONDS
//                        THREADS connections, one thread each, sending
//                        100-byte requests and reading their 100-byte
//                        echo for SECONDS; prints the requests per second
//                        (scripts/java-bench.sh)
//   asyncclose PORT      readers blocked in read while another thread
//                        closes the socket or channel, or interrupts the
//                        reader; prints "ok CONNS BYTES" (BYTES echoed
//                        before) if each reader wakes as the JDK says
import java.io.*;
import java.net.*;
import java.nio.ByteBuffer;
import java.nio.channels.*;
import java.util.*;
import java.util.concurrent.*;

public class Echo {
    public static void main(String[] a) throws Exception {
        int port = Integer.parseInt(a[1]);
        switch (a[0]) {
            case "server" -> server(port);
            case "nioserver" -> nioServer(port);
            case "client" -> client(port, Integer.parseInt(a[2]));
            case "asyncclose" -> asyncClose(port);
            case "load" -> load(port, Integer.parseInt(a[2]), Double.parseDouble(a[3]));
            default -> throw new IllegalArgumentException(a[0]);
        }
    }

    static void server(int port) throws Exception {
        ServerSocket ss = new ServerSocket();
        ss.bind(new InetSocketAddress("127.0.0.1", port));
        ExecutorService ex = Executors.newCachedThreadPool();
        while (true) {
            Socket s = ss.accept();
            ex.submit(() -> {
                try (s) {
                    InputStream in = s.getInputStream();
                    OutputStream out = s.getOutputStream();
                    byte[] b = new byte[65536];
                    int n;
                    while ((n = in.read(b)) > 0) out.write(b, 0, n);
                } catch (IOException e) {
                    System.err.println("server: " + e);
                }
                return null;
            });
        }
    }

    static void nioServer(int port) throws Exception {
        Selector sel = Selector.open();
        ServerSocketChannel ssc = ServerSocketChannel.open();
        ssc.bind(new InetSocketAddress("127.0.0.1", port));
        ssc.configureBlocking(false);
        ssc.register(sel, SelectionKey.OP_ACCEPT);
        ByteBuffer buf = ByteBuffer.allocateDirect(65536);
        while (true) {
            sel.select();
            Iterator<SelectionKey> it = sel.selectedKeys().iterator();
            while (it.hasNext()) {
                SelectionKey k = it.next();
                it.remove();
                if (k.isAcceptable()) {
                    SocketChannel c = ssc.accept();
                    if (c == null) continue;
                    c.configureBlocking(false);
                    c.register(sel, SelectionKey.OP_READ);
                } else if (k.isReadable()) {
                    SocketChannel c = (SocketChannel) k.channel();
                    buf.clear();
                    int n = c.read(buf);
                    if (n < 0) {
                        k.cancel();
                        c.close();
                        continue;
                    }
                    buf.flip();
                    // The client reads while it writes, so the echo drains.
                    while (buf.hasRemaining()) c.write(buf);
                }
            }
        }
    }

    static void client(int port, int conns) throws Exception {
        ExecutorService ex = Executors.newFixedThreadPool(8);
        List<Future<Long>> fs = new ArrayList<>();
        for (int i = 0; i < conns; i++) {
            final int id = i;
            fs.add(ex.submit(() -> echoOnce(port, id)));
        }
        long total = 0;
        for (Future<Long> f : fs) total += f.get();
        ex.shutdown();
        System.out.println("ok " + conns + " " + total);
    }

    static long echoOnce(int port, int id) throws Exception {
        Random r = new Random(id);
        byte[] msg = new byte[1 + r.nextInt(200000)];
        r.nextBytes(msg);
        try (Socket s = new Socket("127.0.0.1", port)) {
            s.setSoTimeout(20000);
            OutputStream out = s.getOutputStream();
            InputStream in = s.getInputStream();
            Thread w = new Thread(() -> {
                try {
                    out.write(msg);
                    s.shutdownOutput();
                } catch (IOException e) {
                    System.err.println("write: " + e);
                }
            });
            w.start();
            byte[] got = in.readAllBytes();
            w.join();
            if (!Arrays.equals(got, msg))
                throw new IOException("connection " + id + ": echo of " + got.length + " bytes, sent " + msg.length);
            return got.length;
        }
    }

    static void load(int port, int threads, double secs) throws Exception {
        long end = System.nanoTime() + (long) (secs * 1e9);
        long[] done = new long[threads];
        Thread[] ts = new Thread[threads];
        for (int i = 0; i < threads; i++) {
            final int id = i;
            ts[i] = new Thread(() -> {
                try (Socket s = new Socket("127.0.0.1", port)) {
                    s.setTcpNoDelay(true);
                    OutputStream out = s.getOutputStream();
                    InputStream in = s.getInputStream();
                    byte[] req = new byte[100];
                    while (System.nanoTime() < end) {
                        out.write(req);
                        if (in.readNBytes(req, 0, 100) != 100) throw new IOException("end of stream");
                        done[id]++;
                    }
                } catch (IOException e) {
                    System.err.println("load: " + e);
                    System.exit(1);
                }
            });
            ts[i].start();
        }
        long total = 0;
        for (int i = 0; i < threads; i++) {
            ts[i].join();
            total += done[i];
        }
        System.out.printf("%.0f%n", total / secs);
    }

    // A reader blocked in read must wake when another thread closes its
    // socket (the JDK then dup2s a dead descriptor onto the socket's
    // number and signals the reader) or interrupts it (NIO).
    static void asyncClose(int port) throws Exception {
        int conns = 0, bytes = 0;
        for (int i = 0; i < 3; i++, conns++) {
            Socket s = new Socket("127.0.0.1", port);
            s.getOutputStream().write('x');
            if (s.getInputStream().read() != 'x') throw new IOException("no echo");
            bytes++;
            expectWakes("socket close", () -> s.getInputStream().read(new byte[10]), s::close, SocketException.class);
        }
        for (int i = 0; i < 3; i++, conns++) {
            SocketChannel c = SocketChannel.open(new InetSocketAddress("127.0.0.1", port));
            expectWakes("channel close", () -> c.read(ByteBuffer.allocate(10)), c::close, AsynchronousCloseException.class);
        }
        SocketChannel c = SocketChannel.open(new InetSocketAddress("127.0.0.1", port));
        conns++;
        Thread[] reader = new Thread[1];
        expectWakes("interrupt", () -> {
            reader[0] = Thread.currentThread();
            return c.read(ByteBuffer.allocate(10));
        }, () -> reader[0].interrupt(), ClosedByInterruptException.class);
        System.out.println("ok " + conns + " " + bytes);
    }

    interface Blocking { int run() throws IOException; }
    interface Action { void run() throws IOException; }

    static void expectWakes(String what, Blocking read, Action wake, Class<?> want) throws Exception {
        Throwable[] seen = new Throwable[1];
        Thread t = new Thread(() -> {
            try {
                int n = read.run();
                seen[0] = new IOException("read returned " + n);
            } catch (Throwable e) {
                seen[0] = e;
            }
        });
        t.start();
        Thread.sleep(200);
        if (!t.isAlive()) throw new IOException(what + ": the read did not block: " + seen[0]);
        wake.run();
        t.join(5000);
        if (t.isAlive()) throw new IOException(what + ": the blocked reader did not wake within 5 s");
        if (!want.isInstance(seen[0])) throw new IOException(what + ": the reader got " + seen[0] + ", want " + want.getSimpleName());
    }
}
