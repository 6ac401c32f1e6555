import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.retry.ExponentialBackoffRetry;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.framework.recipes.locks.InterProcessReadWriteLock;
import org.apache.curator.framework.recipes.locks.InterProcessSemaphoreV2;
import org.apache.curator.framework.recipes.locks.Lease;
import java.util.concurrent.TimeUnit;

/**
 * Curator's side of the interop tests: args are connect string, path, mode, milliseconds
 * (how long to hold, or to wait), and for a semaphore its number of leases.
 *
 * Modes: hold / try (InterProcessMutex), rw-read-hold / rw-read-try / rw-write-hold /
 * rw-write-try (InterProcessReadWriteLock), sem-hold / sem-try (InterProcessSemaphoreV2).
 * A hold prints HELD, then RELEASED; a try prints GOT or BUSY.
 *
 * Mode fleet (a mixed fleet's holder, lockkit-zk/tests/mixed_fleet.rs): args are connect
 * string, first path, fleet, how long to run (ms), the ledger file, a seed, second path.
 * Until then takes one of the two InterProcessMutexes at random (waiting up to 30 s),
 * appends `enter <i> curator-<pid>` to the ledger, holds up to 30 ms, appends `exit ...`
 * and releases; prints its holds.
 */
public class Interop {
  static void say(String s) { System.out.println(s); System.out.flush(); }

  static void fleet(CuratorFramework c, String[] paths, long ms, String ledgerPath, long seed)
      throws Exception {
    java.util.Random random = new java.util.Random(seed);
    InterProcessMutex[] locks = new InterProcessMutex[paths.length];
    for (int i = 0; i < paths.length; i++) locks[i] = new InterProcessMutex(c, paths[i]);
    String me = "curator-" + ProcessHandle.current().pid();
    long end = System.nanoTime() + ms * 1_000_000L;
    int holds = 0;
    try (java.io.FileOutputStream ledger = new java.io.FileOutputStream(ledgerPath, true)) {
      while (System.nanoTime() < end) {
        int i = random.nextInt(paths.length);
        if (!locks[i].acquire(30, TimeUnit.SECONDS)) {
          say("curator never got path " + i + " in 30 s");
          System.exit(1);
        }
        // One write per line, appended whole (O_APPEND).
        ledger.write(("enter " + i + " " + me + "\n").getBytes());
        Thread.sleep(random.nextInt(30));
        ledger.write(("exit " + i + " " + me + "\n").getBytes());
        locks[i].release();
        holds++;
      }
    }
    say(Integer.toString(holds));
  }

  public static void main(String[] a) throws Exception {
    // Retries as an application would configure them: a loaded CI machine can drop a
    // first connection (the helper once ended before saying anything).
    CuratorFramework c = CuratorFrameworkFactory.newClient(a[0], new ExponentialBackoffRetry(100, 6));
    c.start();
    if (!c.blockUntilConnected(60, TimeUnit.SECONDS)) {
      throw new IllegalStateException("no ZooKeeper connection within 60 s");
    }
    String mode = a[2];
    long ms = Long.parseLong(a[3]);
    if (mode.equals("fleet")) {
      fleet(c, new String[] {a[1], a[6]}, ms, a[4], Long.parseLong(a[5]));
      c.close();
      return;
    }
    if (mode.startsWith("sem-")) {
      InterProcessSemaphoreV2 s = new InterProcessSemaphoreV2(c, a[1], Integer.parseInt(a[4]));
      if (mode.equals("sem-hold")) {
        Lease l = s.acquire();
        say("HELD");
        Thread.sleep(ms);
        s.returnLease(l);
        say("RELEASED");
      } else {
        Lease l = s.acquire(ms, TimeUnit.MILLISECONDS);
        say(l != null ? "GOT" : "BUSY");
        if (l != null) s.returnLease(l);
      }
    } else {
      InterProcessMutex m;
      if (mode.startsWith("rw-")) {
        InterProcessReadWriteLock rw = new InterProcessReadWriteLock(c, a[1]);
        m = mode.startsWith("rw-read-") ? rw.readLock() : rw.writeLock();
      } else {
        m = new InterProcessMutex(c, a[1]);
      }
      if (mode.endsWith("hold")) {
        m.acquire();
        say("HELD");
        Thread.sleep(ms);
        m.release();
        say("RELEASED");
      } else {
        boolean got = m.acquire(ms, TimeUnit.MILLISECONDS);
        say(got ? "GOT" : "BUSY");
        if (got) m.release();
      }
    }
    c.close();
  }
}
