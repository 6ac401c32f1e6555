import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.retry.RetryOneTime;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import java.util.concurrent.TimeUnit;

public class Interop {
  public static void main(String[] a) throws Exception {
    CuratorFramework c = CuratorFrameworkFactory.newClient(a[0], new RetryOneTime(100));
    c.start();
    InterProcessMutex m = new InterProcessMutex(c, a[1]);
    if (a[2].equals("hold")) {
      m.acquire();
      System.out.println("HELD"); System.out.flush();
      Thread.sleep(Long.parseLong(a[3]));
      m.release();
      System.out.println("RELEASED"); System.out.flush();
    } else {
      boolean got = m.acquire(Long.parseLong(a[3]), TimeUnit.MILLISECONDS);
      System.out.println(got ? "GOT" : "BUSY"); System.out.flush();
      if (got) m.release();
    }
    c.close();
  }
}
