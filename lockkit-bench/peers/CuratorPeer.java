// Apache Curator's InterProcessMutex for lockkit's peer benchmark (`scripts/perf.sh`).
//
//     java -cp <out>:<Debian's Curator jars> CuratorPeer 127.0.0.1:12181
//
// The same line protocol as peer.py: `same N`, `new N`, `wake R`, `handoff W R`, `quit`,
// each answered by one JSON line {"us": [...]} or {"error": "..."}. One CuratorFramework
// (one session) per contender, as an application runs one per process.

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.ArrayList;
import java.util.List;
import java.util.UUID;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.retry.ExponentialBackoffRetry;

public class CuratorPeer {
    static final String RUN = UUID.randomUUID().toString().substring(0, 8);
    static String connect;
    static long counter = 0;

    static CuratorFramework client() throws Exception {
        CuratorFramework c = CuratorFrameworkFactory.newClient(connect, 30000, 15000,
                new ExponentialBackoffRetry(100, 3));
        c.start();
        if (!c.blockUntilConnected(30, TimeUnit.SECONDS)) {
            throw new IllegalStateException("no ZooKeeper connection");
        }
        return c;
    }

    static double micros(long nanos) {
        return Math.round(nanos / 100.0) / 10.0;
    }

    static List<Double> uncontended(CuratorFramework c, int n, boolean newKey) throws Exception {
        List<Double> out = new ArrayList<>();
        for (int i = 0; i < n; i++) {
            String path = newKey ? "/peerbench/" + RUN + "/new/" + (counter + i) : "/peerbench/" + RUN + "/same";
            long start = System.nanoTime();
            InterProcessMutex m = new InterProcessMutex(c, path);
            m.acquire();
            m.release();
            out.add(micros(System.nanoTime() - start));
        }
        counter += n;
        return out;
    }

    static List<Double> wake(CuratorFramework holder, int rounds) throws Exception {
        CuratorFramework other = client();
        List<Double> out = new ArrayList<>();
        try {
            for (int r = 0; r < rounds; r++) {
                String path = "/peerbench/" + RUN + "/wake/" + r;
                InterProcessMutex held = new InterProcessMutex(holder, path);
                held.acquire();
                AtomicReference<Long> granted = new AtomicReference<>();
                Thread waiter = new Thread(() -> {
                    try {
                        InterProcessMutex m = new InterProcessMutex(other, path);
                        if (m.acquire(120, TimeUnit.SECONDS)) {
                            granted.set(System.nanoTime());
                            m.release();
                        }
                    } catch (Exception e) {
                        // reported below as a missing grant
                    }
                });
                waiter.start();
                Thread.sleep(200 + (long) (Math.random() * 100));
                long released = System.nanoTime();
                held.release();
                waiter.join(120000);
                if (granted.get() == null) {
                    throw new IllegalStateException("wake: the waiter was never granted");
                }
                out.add(micros(granted.get() - released));
            }
        } finally {
            other.close();
        }
        return out;
    }

    static List<Double> handoff(int waiters, int rounds) throws Exception {
        String path = "/peerbench/" + RUN + "/hot/" + UUID.randomUUID().toString().substring(0, 6);
        List<Double> out = new ArrayList<>();
        Object guard = new Object();
        long[] released = {-1};
        List<CuratorFramework> clients = new ArrayList<>();
        List<Thread> threads = new ArrayList<>();
        AtomicReference<Exception> failure = new AtomicReference<>();
        for (int w = 0; w < waiters; w++) {
            CuratorFramework c = client();
            clients.add(c);
            threads.add(new Thread(() -> {
                try {
                    InterProcessMutex m = new InterProcessMutex(c, path);
                    for (int r = 0; r < rounds; r++) {
                        if (!m.acquire(120, TimeUnit.SECONDS)) {
                            throw new IllegalStateException("handoff acquire timed out");
                        }
                        long granted = System.nanoTime();
                        synchronized (guard) {
                            if (released[0] >= 0) {
                                out.add(micros(granted - released[0]));
                            }
                            released[0] = System.nanoTime();
                        }
                        m.release();
                    }
                } catch (Exception e) {
                    failure.compareAndSet(null, e);
                }
            }));
        }
        for (Thread t : threads) t.start();
        for (Thread t : threads) t.join();
        for (CuratorFramework c : clients) c.close();
        if (failure.get() != null) throw failure.get();
        return out;
    }

    static String json(List<Double> samples) {
        StringBuilder b = new StringBuilder("{\"us\": [");
        for (int i = 0; i < samples.size(); i++) {
            if (i > 0) b.append(", ");
            b.append(samples.get(i));
        }
        return b.append("]}").toString();
    }

    public static void main(String[] args) throws Exception {
        connect = args[0];
        CuratorFramework c = client();
        System.out.println("{\"ready\": true}");
        System.out.flush();
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        String line;
        while ((line = in.readLine()) != null) {
            String[] w = line.trim().split("\\s+");
            if (w[0].isEmpty()) continue;
            if (w[0].equals("quit")) break;
            try {
                List<Double> out;
                switch (w[0]) {
                    case "same": out = uncontended(c, Integer.parseInt(w[1]), false); break;
                    case "new": out = uncontended(c, Integer.parseInt(w[1]), true); break;
                    case "wake": out = wake(c, Integer.parseInt(w[1])); break;
                    case "handoff": out = handoff(Integer.parseInt(w[1]), Integer.parseInt(w[2])); break;
                    default: throw new IllegalArgumentException("unknown command " + w[0]);
                }
                System.out.println(json(out));
            } catch (Exception e) {
                System.out.println("{\"error\": \"" + e.toString().replace("\\", "\\\\").replace("\"", "'") + "\"}");
            }
            System.out.flush();
        }
        c.close();
        System.exit(0);
    }
}
